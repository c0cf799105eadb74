"""`neuron-diffusers plan ...`: report what a plan costs, lint it against a model's shapes, verify it numerically."""
