"""The benchmark (`python -m playground bench`): the harness that races every algorithm against plain decoding and
its peers (`harness`), the prompt suite (`suite`), the peers' runs (`peers`), the report and its goals (`report`),
the serving suite (`serving`) and the kernel's efficiency against the FMA bound (`kernel`)."""
