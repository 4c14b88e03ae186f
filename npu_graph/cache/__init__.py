"""The compile cache: the key computed before capture (key), what an entry holds (entry), one entry folder on
disk (folder), the store with its locks, LRU and counters (disk_store), what is trusted on disk (trust), export
and import between machines (transfer), and the backend's use of all of it (manager)."""
