	.file	"<string>"
	.section	.ltext,"axl",@progbits
	.globl	_ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax
	.p2align	4
	.type	_ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax,@function
_ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax:
	testq	%r9, %r9
	jle	.LBB0_4
	leaq	(,%r9,4), %rax
	leaq	(%rax,%rax,2), %rax
	addq	$192, %rcx
	vxorps	%xmm0, %xmm0, %xmm0
	movq	%r9, %rsi
	vxorps	%xmm1, %xmm1, %xmm1
	vxorps	%xmm2, %xmm2, %xmm2
	vxorps	%xmm3, %xmm3, %xmm3
	vxorps	%xmm4, %xmm4, %xmm4
	vxorps	%xmm5, %xmm5, %xmm5
	vxorps	%xmm6, %xmm6, %xmm6
	vxorps	%xmm7, %xmm7, %xmm7
	vxorps	%xmm8, %xmm8, %xmm8
	vxorps	%xmm9, %xmm9, %xmm9
	vxorps	%xmm10, %xmm10, %xmm10
	vxorps	%xmm11, %xmm11, %xmm11
	vxorps	%xmm12, %xmm12, %xmm12
	vxorps	%xmm13, %xmm13, %xmm13
	vxorps	%xmm14, %xmm14, %xmm14
	vxorps	%xmm15, %xmm15, %xmm15
	.p2align	4
.LBB0_2:
	vbroadcastss	(%rdx), %zmm16
	vmovups	-192(%rcx), %zmm17
	vmovups	-128(%rcx), %zmm18
	vmovups	-64(%rcx), %zmm19
	vmovups	(%rcx), %zmm20
	vfmadd231ps	%zmm16, %zmm17, %zmm15
	vfmadd231ps	%zmm16, %zmm18, %zmm14
	vfmadd231ps	%zmm16, %zmm19, %zmm13
	vfmadd231ps	%zmm16, %zmm20, %zmm12
	vbroadcastss	(%rdx,%r9,4), %zmm16
	vfmadd231ps	%zmm16, %zmm17, %zmm11
	vfmadd231ps	%zmm16, %zmm18, %zmm10
	vfmadd231ps	%zmm16, %zmm19, %zmm9
	vfmadd231ps	%zmm16, %zmm20, %zmm8
	vbroadcastss	(%rdx,%r9,8), %zmm16
	vfmadd231ps	%zmm16, %zmm17, %zmm7
	vfmadd231ps	%zmm16, %zmm18, %zmm6
	vfmadd231ps	%zmm16, %zmm19, %zmm5
	vfmadd231ps	%zmm16, %zmm20, %zmm4
	vbroadcastss	(%rdx,%rax), %zmm16
	vfmadd231ps	%zmm17, %zmm16, %zmm3
	vfmadd231ps	%zmm18, %zmm16, %zmm2
	vfmadd231ps	%zmm19, %zmm16, %zmm1
	vfmadd231ps	%zmm16, %zmm20, %zmm0
	addq	$4, %rdx
	addq	$256, %rcx
	decq	%rsi
	jne	.LBB0_2
	vmovups	%zmm15, (%r8)
	vmovups	%zmm14, 64(%r8)
	vmovups	%zmm13, 128(%r8)
	vmovups	%zmm12, 192(%r8)
	vmovups	%zmm11, 256(%r8)
	vmovups	%zmm10, 320(%r8)
	vmovups	%zmm9, 384(%r8)
	vmovups	%zmm8, 448(%r8)
	vmovups	%zmm7, 512(%r8)
	vmovups	%zmm6, 576(%r8)
	vmovups	%zmm5, 640(%r8)
	vmovups	%zmm4, 704(%r8)
	vmovups	%zmm3, 768(%r8)
	vmovups	%zmm2, 832(%r8)
	vmovups	%zmm1, 896(%r8)
	vmovups	%zmm0, 960(%r8)
	movq	$0, (%rdi)
	xorl	%eax, %eax
	vzeroupper
	retq
.LBB0_4:
	vxorps	%xmm0, %xmm0, %xmm0
	vmovups	%zmm0, 960(%r8)
	vmovups	%zmm0, 896(%r8)
	vmovups	%zmm0, 832(%r8)
	vmovups	%zmm0, 768(%r8)
	vmovups	%zmm0, 704(%r8)
	vmovups	%zmm0, 640(%r8)
	vmovups	%zmm0, 576(%r8)
	vmovups	%zmm0, 512(%r8)
	vmovups	%zmm0, 448(%r8)
	vmovups	%zmm0, 384(%r8)
	vmovups	%zmm0, 320(%r8)
	vmovups	%zmm0, 256(%r8)
	vmovups	%zmm0, 192(%r8)
	vmovups	%zmm0, 128(%r8)
	vmovups	%zmm0, 64(%r8)
	vmovups	%zmm0, (%r8)
	movq	$0, (%rdi)
	xorl	%eax, %eax
	vzeroupper
	retq
.Lfunc_end0:
	.size	_ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax, .Lfunc_end0-_ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax

	.globl	_ZN7cpython8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax
	.p2align	4
	.type	_ZN7cpython8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax,@function
_ZN7cpython8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax:
	.cfi_startproc
	pushq	%rbx
	.cfi_def_cfa_offset 16
	subq	$32, %rsp
	.cfi_def_cfa_offset 48
	.cfi_offset %rbx, -16
	movq	%rsi, %rdi
	movq	%rsp, %r10
	leaq	8(%rsp), %r11
	movabsq	$.const.qk4, %rsi
	movabsq	$PyArg_UnpackTuple, %rbx
	leaq	24(%rsp), %r8
	leaq	16(%rsp), %r9
	movl	$4, %edx
	movl	$4, %ecx
	xorl	%eax, %eax
	pushq	%r10
	.cfi_adjust_cfa_offset 8
	pushq	%r11
	.cfi_adjust_cfa_offset 8
	callq	*%rbx
	addq	$16, %rsp
	.cfi_adjust_cfa_offset -16
	testl	%eax, %eax
	je	.LBB1_4
	movabsq	$_ZN08NumbaEnv8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax, %rax
	cmpq	$0, (%rax)
	je	.LBB1_2
	movabsq	$PyExc_TypeError, %rdi
	movabsq	$".const.can't unbox float32* type", %rsi
.LBB1_3:
	movabsq	$PyErr_SetString, %rax
	callq	*%rax
.LBB1_4:
	xorl	%eax, %eax
	addq	$32, %rsp
	.cfi_def_cfa_offset 16
	popq	%rbx
	.cfi_def_cfa_offset 8
	retq
.LBB1_2:
	.cfi_def_cfa_offset 48
	movabsq	$PyExc_RuntimeError, %rdi
	movabsq	$".const.missing Environment: _ZN08NumbaEnv8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax", %rsi
	jmp	.LBB1_3
.Lfunc_end1:
	.size	_ZN7cpython8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax, .Lfunc_end1-_ZN7cpython8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax
	.cfi_endproc

	.globl	cfunc._ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax
	.p2align	4
	.type	cfunc._ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax,@function
cfunc._ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax:
	.cfi_startproc
	pushq	%r14
	.cfi_def_cfa_offset 16
	pushq	%rbx
	.cfi_def_cfa_offset 24
	subq	$24, %rsp
	.cfi_def_cfa_offset 48
	.cfi_offset %rbx, -24
	.cfi_offset %r14, -16
	movq	%rcx, %r9
	movq	%rdx, %r8
	movq	%rsi, %rcx
	movq	%rdi, %rdx
	movq	$0, 16(%rsp)
	movabsq	$_ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax, %rax
	leaq	16(%rsp), %rdi
	callq	*%rax
	movq	16(%rsp), %rcx
	movl	$0, 12(%rsp)
	testl	%eax, %eax
	jne	.LBB2_1
.LBB2_5:
	movq	%rcx, %rax
	addq	$24, %rsp
	.cfi_def_cfa_offset 24
	popq	%rbx
	.cfi_def_cfa_offset 16
	popq	%r14
	.cfi_def_cfa_offset 8
	retq
.LBB2_1:
	.cfi_def_cfa_offset 48
	movq	%rcx, %r14
	movabsq	$numba_gil_ensure, %rcx
	leaq	12(%rsp), %rdi
	movl	%eax, %ebx
	callq	*%rcx
	testl	%ebx, %ebx
	jg	.LBB2_2
	movl	%ebx, %eax
	cmpl	$-1, %ebx
	je	.LBB2_4
	cmpl	$-3, %eax
	jne	.LBB2_3
	movabsq	$PyExc_StopIteration, %rdi
	movabsq	$PyErr_SetNone, %rax
	callq	*%rax
	jmp	.LBB2_4
.LBB2_3:
	movabsq	$PyExc_SystemError, %rdi
	movabsq	$".const.unknown error when calling native function", %rsi
	movabsq	$PyErr_SetString, %rax
	callq	*%rax
.LBB2_4:
	movabsq	$".const.<numba.core.cpu.CPUContext>", %rdi
	movabsq	$PyUnicode_FromString, %rax
	callq	*%rax
	movq	%rax, %rbx
	movabsq	$PyErr_WriteUnraisable, %rax
	movq	%rbx, %rdi
	callq	*%rax
	movabsq	$Py_DecRef, %rax
	movq	%rbx, %rdi
	callq	*%rax
	movabsq	$numba_gil_release, %rax
	leaq	12(%rsp), %rdi
	callq	*%rax
	movq	%r14, %rcx
	jmp	.LBB2_5
.LBB2_2:
	movabsq	$PyErr_Clear, %rax
	callq	*%rax
.Lfunc_end2:
	.size	cfunc._ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax, .Lfunc_end2-cfunc._ZN8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax
	.cfi_endproc

	.type	.const.qk4,@object
	.section	.lrodata,"al",@progbits
.const.qk4:
	.asciz	"qk4"
	.size	.const.qk4, 4

	.type	_ZN08NumbaEnv8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax,@object
	.comm	_ZN08NumbaEnv8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax,8,8
	.type	".const.missing Environment: _ZN08NumbaEnv8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax",@object
	.p2align	4, 0x0
".const.missing Environment: _ZN08NumbaEnv8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax":
	.asciz	"missing Environment: _ZN08NumbaEnv8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax"
	.size	".const.missing Environment: _ZN08NumbaEnv8__main__3qk4B2v8B118c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1fOKq9R1FNST8_2fNKihKTS0DsxLQ8EFUETGjF_2bclgkaLkAvVaTWB8FEHs1QQAE10float32_2a10float32_2a10float32_2ax", 212

	.type	".const.can't unbox float32* type",@object
	.p2align	4, 0x0
".const.can't unbox float32* type":
	.asciz	"can't unbox float32* type"
	.size	".const.can't unbox float32* type", 26

	.type	".const.unknown error when calling native function",@object
	.p2align	4, 0x0
".const.unknown error when calling native function":
	.asciz	"unknown error when calling native function"
	.size	".const.unknown error when calling native function", 43

	.type	".const.<numba.core.cpu.CPUContext>",@object
	.p2align	4, 0x0
".const.<numba.core.cpu.CPUContext>":
	.asciz	"<numba.core.cpu.CPUContext>"
	.size	".const.<numba.core.cpu.CPUContext>", 28

	.type	_ZN08NumbaEnv10sdpa_numba3cpu11microkernel10_pass_rows12_3clocals_3e12_3clambda_3eB2v4B112c8tJTIeFIjxB2IKSgI4CrvQCk0Z4yRYcWsCAgXrKFt1X1ep5xVXqOgrqyfl5JUWJySUgdmJaHogqAiar4vxksEhRcoF6rSYw9DHSB9RSYPiCWZoAE10float32_2ax,@object
	.comm	_ZN08NumbaEnv10sdpa_numba3cpu11microkernel10_pass_rows12_3clocals_3e12_3clambda_3eB2v4B112c8tJTIeFIjxB2IKSgI4CrvQCk0Z4yRYcWsCAgXrKFt1X1ep5xVXqOgrqyfl5JUWJySUgdmJaHogqAiar4vxksEhRcoF6rSYw9DHSB9RSYPiCWZoAE10float32_2ax,8,8
	.section	".note.GNU-stack","",@progbits
