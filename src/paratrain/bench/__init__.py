"""Benchmarks of the hardware a job runs on: collectives (`comm`) and one device (`compute`)."""
