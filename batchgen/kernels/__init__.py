"""Kernels the model runner uses: paged attention backends (C on CPU, Triton on CUDA), packed linears."""
