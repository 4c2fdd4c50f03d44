"""Parallel dimensions beyond tensor parallelism, built on torch's engines (``fsdp``: FSDP2;
``pipeline``: pipeline stages on ``torch.distributed.pipelining``)."""
