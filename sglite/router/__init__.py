"""The router: one HTTP front for several sglite workers, sending each request where its
prefix is most likely cached (`sglite router --worker-urls ...`; see docs/router.md)."""
