"""Platform adapters' pure parts: what a platform's objects and metrics mean to budgetgate
(DCGM scrapes to usage, Kubernetes objects to submissions), without I/O."""
