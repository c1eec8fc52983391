"""What the test files share: device arrays, argument checks, C layouts, child processes, collective
drivers, MPI jobs and the problems of the larger test files. No test file imports another test file."""
