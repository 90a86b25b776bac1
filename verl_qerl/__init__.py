"""verl-qerl: QeRL (NVFP4 base weights + LoRA + Adaptive Quantization Noise) for verl.

Importing the package is cheap and safe on any machine: it imports torch only through the
subpackages that need it, and never touches CUDA, vLLM or verl at import time.
"""

__version__ = "0.1.0"
