"""The one place that touches transformers internals: this package, and no module outside it.

It loads a model + tokenizer (from what infinigen/models.py checks and locates without importing torch), exposes the
per-layer pieces KV methods need (`AttentionLayer`), registers this project's attention function through the public
`AttentionInterface` / `AttentionMaskInterface`, and installs a KV method into a model for the duration of a
`with install(...)` block (hooks removed on exit). One concept a module:

* `loading`: the device, a model's config, the model and tokenizer (GGUF files through a one-time conversion), and
  which tokenizer a model reads (byte-level text for random-init models);
* `layers`: the per-layer view of a decoder (its blocks, norms, LM head, feed-forward span, `AttentionLayer`);
* `store`: `KVStore`, the transformers cache layer holding the KV a method keeps, and `new_cache`;
* `session`: `Session` and `install`: the attention and mask functions registered with transformers, the hooks that
  capture what a method reads, and the model's own attention for reference forwards (`attn_implementation`);
* `generation`: which `model.generate` calls a method's cache can run, and the hook that checks them.

Here: the names the rest of the project imports from `infinigen.adapter`.
"""

from infinigen.adapter.generation import check_generation, generate_hook, generation_config, max_length  # noqa: F401
from infinigen.adapter.layers import (  # noqa: F401
    AttentionLayer, attention_layers, decoder_layers, ffn_span, final_hidden, lm_head, norm_weight_only,
)
from infinigen.adapter.loading import (  # noqa: F401
    byte_tokenizer, encode, load, model_config, reads_bytes, remember_tokenizer, resolve_device, tokenizer_of,
)
from infinigen.adapter.session import (  # noqa: F401
    _BOUND, ATTN_NAME, PADDED, Session, attn_implementation, install,
)
from infinigen.adapter.store import KVStore, new_cache, prefix_cache, resume_cache  # noqa: F401
from infinigen.models import ATTENTION_KERNELS, ModelUnavailable, validate_model  # noqa: F401 (re-exported)
