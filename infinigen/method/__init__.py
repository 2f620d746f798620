"""The InfiniGen method (Lee et al., OSDI'24) and its parts: skewing, selective attention over a KV pool, token
selection and pool eviction rules (the last two shared with the oracle baseline)."""
