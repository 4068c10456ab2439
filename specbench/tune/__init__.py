"""`specbench tune`: a method's search space, the cost model that predicts each setting's speedup, the calibration
and verification runs, and the command."""
