"""kvferry.testing: kvferry's test kit (the kvferry-dev distribution, never in the server's wheel).

- :mod:`~kvferry.testing.standin_engine`: the FAST STAND-IN engine ``kvferry bench router``, tests/router and
  tests/faults run the router against (beside the real-engine tests of the same paths).

The reusable parts of the fault harness, shared by ``tests/faults`` and ``kvferry bench faults``:

- :mod:`~kvferry.testing.loop_thread`: an event loop in a thread of its own, so synchronous tests
  (hypothesis) drive real async services;
- :mod:`~kvferry.testing.fault_proxy`: a loopback TCP proxy that adds latency, cuts or black-holes
  connections, and tells etcd peers apart (a partition of one member from the others);
- :mod:`~kvferry.testing.etcd_cluster`: a 3-member etcd cluster of real etcd binaries, with leader
  kills, partitions, compaction, a space quota, snapshots and restores;
- :mod:`~kvferry.testing.processes`: child processes the harness starts and kills (SIGKILL);
- :mod:`~kvferry.testing.oracle`: reads the engines' free and pull logs and checks rule 1 of
  docs/design.md (no block is served after D freed it), that every fenced pull became a recompute, and that
  no block stays held.
"""
