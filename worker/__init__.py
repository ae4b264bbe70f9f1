"""pdserve.worker: what a prefill worker and a decode worker share (``base.py``)."""
