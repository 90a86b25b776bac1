// Stub for the binding syntax check in .ci/compile_cuda.sh (see cusparse.h).
#pragma once
typedef int cusolverStatus_t;
