"""Training the reference model on the Python standard library's sources (byte level): corpus and fixed split
(`corpus`), the training loop with the indexer's KL and the routers' balance losses (`loop`), checkpoints
(`checkpoint`) and the loss curve (`curve`)."""
