"""What an engine measures about itself (torch-free): step timings for load reports and metrics,
shared by `engine.engine.Engine` and the capacity planner's simulated pods (`cbserve.planner`)."""
