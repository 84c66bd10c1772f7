"""SmoothQuant W8A8 (mit-han-lab/smoothquant): activation smoothing into the LayerNorms, then W8A8."""
