"""`tandem serve`: start the cluster from a config and serve the OpenAI API until Ctrl-C."""

from __future__ import annotations

import argparse

from tandem.defaults import DEFAULT_CONFIG


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--config", default=str(DEFAULT_CONFIG),
                       help="YAML config (default: configs/default.yaml, SmolLM2-135M-Instruct)")
    serve.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    serve.add_argument("--host", default=None, help="HTTP bind address (default: the config's ingress.host)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's ingress.port)")
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    import ray

    from cluster.control.autoscale.autoscaler import Autoscaler
    from cluster.control.config import TandemConfig
    from cluster.control.lifecycle.launch import Cluster
    from cluster.control.lifecycle.scaling import ConfigWatcher
    from cluster.frontend.http.server import check_exposure, make_server, served_model_name

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = TandemConfig.from_file(args.config)
    host, port = args.host or config.ingress.host, args.port or config.ingress.port
    check_exposure(config.ingress, host)  # before anything starts
    cluster = Cluster.start(config, address=args.address)
    watcher = ConfigWatcher(cluster, args.config).start()  # edits of the pools' replicas resize live
    autoscaler = Autoscaler(cluster, config.autoscaler).start() if config.autoscaler.mode != "off" else None
    try:
        server = make_server(cluster, host, port, autoscaler=autoscaler)
        pools = ", ".join(f"{role} x{pool.replicas}" for role, pool in config.pools().items())
        # The Ray address is what `tandem generate --address` (or RAY_ADDRESS) takes to reach this cluster.
        print(f"tandem: serving model {served_model_name(cluster)!r} ({config.mode}: {pools}) at "
              f"http://{host}:{port}/v1, Ray at {ray.get_runtime_context().gcs_address}; Ctrl-C stops", flush=True)
        try:
            server.run()  # returns (or re-raises the interrupt) after a graceful HTTP shutdown
        except KeyboardInterrupt:
            pass
    finally:
        print("tandem: shutting down", flush=True)
        watcher.stop()
        if autoscaler is not None:
            autoscaler.stop()
        cluster.shutdown()
    return 0
