"""The gguf engine's parts: kernels on GGUF's quantized blocks, their layouts, the layers and the model loader."""
