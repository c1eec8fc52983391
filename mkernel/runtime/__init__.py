"""Layer 1 (on core and the native extension mkernel.verbs): the GPU, arrays and their checks, run-time
compilation (NVRTC) and launch, TMA descriptors, the device-side error/epoch state (sync) and trace."""
