"""The demo, the benchmarks and the harness the integration tests share, run from the checkout's root as a package:
``python -m scripts.swarm``, ``python -m scripts.bench_wan ...``. What several of them use lives in modules of its
own (``benchkit``, ``stats``, ``wan_runs``, ``dht_fill``, ``bars``); no bench imports another."""
