"""Run the reconciler: python -m budgetgate.services.reconciler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from budgetgate.runtime import garbage
from budgetgate.services.reconciler.settings import ReconcilerSettings
from budgetgate.services.reconciler.worker import build


async def _main() -> None:
    settings = ReconcilerSettings()
    reconciler = build(settings)
    garbage.settle(settings.gc_thresholds)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        # HTTPS when a certificate and key are set, like every HTTP service.
        start_http_server(
            settings.metrics_port,
            addr=settings.metrics_host,
            registry=reconciler.telemetry.registry,
            certfile=settings.tls_certfile,
            keyfile=settings.tls_keyfile,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await reconciler.start()
    try:
        await stop.wait()
    finally:
        await reconciler.stop()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main())


if __name__ == "__main__":
    main()
