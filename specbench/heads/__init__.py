"""Draft heads that read the target's hidden states (Medusa, EAGLE-1/2): modules, checkpoints, training."""
