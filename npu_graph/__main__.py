"""`python -m npu_graph` is the `ascend-dsa` command."""
from npu_graph.tools.cli import main

raise SystemExit(main())
