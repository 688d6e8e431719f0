"""The Pallas-Triton toolbox the kernels share: compiling with the `triton` package
(`compile`), launching a one-kernel program without JAX (`launch`), reading captured arrays
inside a kernel (`captured_loads`) and masked tile access (`masked`)."""
