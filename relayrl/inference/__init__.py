"""Generation, in three parts that share only the weight-group layout (``weight_group``):

- ``local``: LocalEngine, in-process continuous batching over any Hugging Face causal LM.
- ``server``: ``relayrl serve``, the HTTP app around LocalEngine, and launching such servers.
- ``remote``: RemoteEngine over HTTP servers, one module per peer (``sglang``, ``vllm``, ``relayrl``).
"""
