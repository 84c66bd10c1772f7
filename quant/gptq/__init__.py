"""Weight-only quantization of the LM settings: GPTQ and its round-to-nearest baseline (IST-DASLab/gptq)."""
