"""Reference models written in plain, unfused PyTorch, the way model authors write them."""
