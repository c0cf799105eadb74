"""`neuron-diffusers bench ...`: commands that print measured figures, ours side by side with the alternative."""
