"""The Hopper backend (Pallas Mosaic GPU): its GEMM engine and, built on it, the backward."""
