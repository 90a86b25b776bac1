// Stub for the binding syntax check in .ci/compile_cuda.sh (see cusparse.h).
#pragma once
typedef struct cublasContext* cublasHandle_t;
typedef int cublasStatus_t;
#define CUBLAS_STATUS_SUCCESS 0
