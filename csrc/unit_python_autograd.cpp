// Build unit: the eager Python entry point, the C++ autograd node and the Watch's reads.
//
// They all include torch's autograd headers (torch/csrc/autograd/function.h,
// python_variable.h), which take most of their compile time: compiled as one
// translation unit, those headers are parsed once instead of once each. The files
// stay separate for reading; a name defined in two of them (even in an anonymous
// namespace) is a compile error here.
#include "autograd.cpp"
#include "python_eager.cpp"
#include "watch.cpp"
