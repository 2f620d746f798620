"""Write a grouped-query model as a checkpoint with one KV head per query head (infinigen/adapter/multihead.py).

The InfiniGen artifact's Llama attention views keys with num_attention_heads, so it ran on SmolLM2-135M this way for
the golden values in tests/data/reference/ (docs/reference.md).

    python -m infinigen.multihead --model smollm2-135m --out /tmp/smollm2-mha          # then +model.local_path=...
    python -m infinigen.multihead --model smollm2-135m --out DIR --for-transformers-4  # also readable by 4.3x
"""

from __future__ import annotations

import argparse
from pathlib import Path

from infinigen.adapter import load
from infinigen.adapter.multihead import repeat_kv_heads, save
from infinigen.models import conf_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a conf/model name (e.g. smollm2-135m)")
    parser.add_argument("--out", required=True, type=Path, help="the checkpoint folder to write")
    parser.add_argument("--for-transformers-4", action="store_true",
                        help="also write the config/tokenizer keys transformers 4.3x reads")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} exists and is not empty: nothing is overwritten")
    from omegaconf import OmegaConf

    model, tokenizer = load(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"))
    save(repeat_kv_heads(model), tokenizer, args.out, args.for_transformers_4)
    print(f"wrote {args.out}: {args.model} with one KV head per query head")


if __name__ == "__main__":
    main()
