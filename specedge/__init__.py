"""specedge: speculative decoding for edge and datacenter NVIDIA GPUs and CPUs."""

__version__ = "0.1.0"
