"""The router: one HTTP front for several sglite workers, sending each request where its
prefix is most likely cached (`sglite router --worker-urls ...`; or, disaggregated, to a
prefill and a decode worker: `--pd-disaggregation --prefill ... --decode ...`; docs/router.md)."""
