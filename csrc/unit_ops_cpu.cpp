// Build unit: the operator schemas and the CPU kernels.
//
// Each file includes ATen/core/Tensor.h and torch/library.h, which take most of
// their compile time: compiled as one translation unit, those headers are parsed
// once instead of three times. The files stay separate for reading; a name defined
// in two of them (even in an anonymous namespace) is a compile error here.
#include "dpmethods.cpp"
#include "cpu/gather_coalesced_cpu.cpp"
#include "cpu/gather_tiles_on_host.cpp"
