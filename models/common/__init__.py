"""Blocks shared by the Qwen family: RMSNorm, RoPE, attention over packed sequences, SwiGLU,
MoE (router + grouped experts), the decoder built from them, its args and HF name mapping.

Model code here is single-device and imports only torch.
"""
