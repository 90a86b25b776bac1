// Stub for the binding syntax check in .ci/compile_cuda.sh (no CUDA math libraries on the CI machine): only the
// names torch's ATen/cuda headers mention. Never used to build anything.
#pragma once
typedef struct cusparseContext* cusparseHandle_t;
typedef int cusparseStatus_t;
#define CUSPARSE_STATUS_SUCCESS 0
inline const char* cusparseGetErrorString(cusparseStatus_t) { return ""; }
