"""Blocks shared by the Qwen family: RMSNorm, RoPE, attention over packed sequences, SwiGLU,
MoE (router + grouped experts), the decoder built from them, its args and HF name mapping.

Model code here is single-device and imports only torch; ``infra/parallelize.py`` is the
decoder's parallel plan, composed from ``parallel/`` (what every decoder package's
``infra/parallelize.py`` points to).
"""
