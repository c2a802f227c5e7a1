// The vector layer: `F16`, sixteen fp32 lanes (one tile of 16 output channels), for the instruction set
// this translation unit is built for (serving/kernels/cpu/isa.py passes -DQG_ISA_<NAME> and that set's
// flags only). The kernels are written once against it; each header is the whole of one ISA.
#pragma once

// A source built without -DQG_ISA_<NAME> (paged attention's -march=native builds) gets the widest set its flags allow.
#if !defined(QG_ISA_AVX512) && !defined(QG_ISA_AVX2) && !defined(QG_ISA_SCALAR)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define QG_ISA_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_ISA_AVX2
#endif
#endif

#if defined(QG_ISA_AVX512)
#include "vec_avx512.h"
#elif defined(QG_ISA_AVX2)
#include "vec_avx2.h"
#else
#include "vec_scalar.h"
#endif
