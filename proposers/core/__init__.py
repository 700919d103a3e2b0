"""The shared runtime: what every proposer family, the verifier and the trainer build on.

Types and the proposer contract, errors and validators, sampling, the tree layer, the KV
cache, the fast forward paths, model / tokenizer loading, the config loader, atomic files,
checkpoint I/O and the engines' export layouts. Nothing here imports another part of
draftsmith: the families (``draftsmith.proposers.<family>``) and ``verify`` import it.
"""
