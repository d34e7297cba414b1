"""What both pods share: the engine thread, gRPC server, health, metrics, load reports and drain."""
