from caffe_compat.cli import console_main

raise SystemExit(console_main())
