"""Reference models written in plain, unfused PyTorch, the way model authors write them, and the checkpoint
folder the reference model is saved in and loaded from (`checkpoint`)."""
