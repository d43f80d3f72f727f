// Build unit: the eager Python entry point and the C++ autograd node.
//
// Both files include torch's autograd headers (torch/csrc/autograd/function.h,
// python_variable.h), which take most of their compile time: compiled as one
// translation unit, those headers are parsed once instead of twice. The files
// stay separate for reading; a name defined in both (even in an anonymous
// namespace) is a compile error here.
#include "autograd.cpp"
#include "python_eager.cpp"
