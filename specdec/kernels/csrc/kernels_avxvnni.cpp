// The 8-bit activation kernels on AVX-VNNI (a8_vnni256.h, the VEX form of vpdpbusd): Intel
// client CPUs from Alder Lake on, which have AVX2 and AVX-VNNI but no AVX-512.  Compiled on its
// own with the AVX2 flags plus -mavxvnni; only called after ops.cpp has checked the CPU.
#define SPECDEC_V256_DPBUSD _mm256_dpbusd_avx_epi32
#define SPECDEC_V256_NAME "avx-vnni"
#define SPECDEC_V256_TABLE avxvnni_a8_table
#define SPECDEC_V256_KQ_TABLE avxvnni_kq_table
#include "a8_vnni256.h"
#include "kq_vnni256.h"
