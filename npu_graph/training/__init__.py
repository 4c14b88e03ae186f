"""Training the reference model on the Python standard library's sources (byte level): corpus and fixed split
(`corpus`), the training loop with the indexer's KL and the routers' balance losses (`loop`: also where
`ascend-dsa train` keeps its checkpoints, in npu_graph.models.checkpoint's format) and the loss curve (`curve`)."""
