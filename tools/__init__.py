"""The `ascend-dsa` command line: demo, bench, inspect, cache."""
