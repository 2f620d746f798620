from analysis.report import main

main()
