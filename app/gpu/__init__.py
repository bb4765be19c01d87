"""The GPU: memory policies, the NVML boundary, the budget, the /gpu report, and calibration."""
