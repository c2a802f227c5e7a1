"""The canary router: a proxy over several servers, its config, its state and the traffic split the fleet ingress shares."""
