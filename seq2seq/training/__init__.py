"""Training: loss, optimisation, distributed helpers and the trainer loop."""
