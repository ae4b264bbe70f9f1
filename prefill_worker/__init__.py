"""pdserve.prefill_worker."""
