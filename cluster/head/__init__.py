"""The processes that serve: the head (``launcher``) with its state files (``state_files``),
``up``/``down`` on the operator's side (``up_down``) and what ``status`` reads (``status_report``);
the router service each router runs (routing plus, on the leader, the control loops), the extra
routers as Ray actors or as ``pdserve router`` processes, and what a dead head left running."""
