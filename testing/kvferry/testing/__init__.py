"""kvferry.testing: the reusable parts of kvferry's fault harness (dev tooling, not in the runtime wheel).

Shared by ``tests/faults`` and ``kvferry bench faults``:

- :mod:`~kvferry.testing.loop_thread`: an event loop in a thread of its own, so synchronous tests
  (hypothesis) drive real async services;
- :mod:`~kvferry.testing.fault_proxy`: a loopback TCP proxy that adds latency, cuts or black-holes
  connections, and tells etcd peers apart (a partition of one member from the others);
- :mod:`~kvferry.testing.etcd_cluster`: a 3-member etcd cluster of real etcd binaries, with leader
  kills, partitions, compaction, a space quota, snapshots and restores;
- :mod:`~kvferry.testing.processes`: child processes the harness starts and kills (SIGKILL);
- :mod:`~kvferry.testing.oracle`: reads the engines' free and pull logs and checks rule 1 of the
  design (no block is served after D freed it), that every fenced pull became a recompute, and that
  no block stays held.
"""
